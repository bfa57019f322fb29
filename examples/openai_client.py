"""Talk to `thunder-batch serve` with the official OpenAI client: list the model, chat, stream a completion.

thunder-batch serve --compile eager          # in another terminal; wait for "Application startup complete"
python examples/openai_client.py             # or --base-url http://HOST:PORT/v1 --api-key KEY
"""

from __future__ import annotations

import argparse
import os

from openai import OpenAI


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Chat and stream through thunder-batch's OpenAI-compatible API.")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    # The client insists on a key; a server started without --api_key ignores it.
    parser.add_argument("--api-key", default=os.environ.get("THUNDER_BATCH_API_KEY", "unused"))
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0)
    model = client.models.list().data[0].id
    print(f"model: {model}")

    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=args.max_tokens,
        temperature=0,  # greedy: the same answer every time
    )
    choice = reply.choices[0]
    print(
        f"chat: {choice.message.content!r} (finish_reason={choice.finish_reason}, "
        f"{reply.usage.prompt_tokens} prompt + {reply.usage.completion_tokens} completion tokens)"
    )

    print("stream: Once upon a time", end="", flush=True)
    stream = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=args.max_tokens,
        temperature=0.8,
        top_p=0.95,
        seed=1234,
        stream=True,
        extra_body={"top_k": 50},
    )  # top_k is an extension to OpenAI's API
    for chunk in stream:
        print(chunk.choices[0].text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
