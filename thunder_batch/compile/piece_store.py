"""The layered program's pieces in the compile cache: each piece's key (the model, config and executors
it is traced with, its kind, its signature, the step's shapes) and, per step shape, the layout of its
blocks (which programs serve the layers, and the checked values found not to matter)."""

from __future__ import annotations

from thunder_batch.compile.cache import CompileCacheFiles, make_key, piece_key, warn
from thunder_batch.compile.executors import describe_options
from thunder_batch.compile.trace_checks import paths_from_json, paths_to_json
from thunder_batch.compile.traced_piece import SharedTraces, TracedPiece, piece_from_record


class PieceKeys:
    """options: the jit options of prefix and block pieces; head_options: the heads' (no fusion)."""

    def __init__(self, store: CompileCacheFiles, program, config, options: dict, head_options: dict) -> None:
        self.store, self.program, self.config = store, program, config
        self._options = {False: options, True: head_options}
        self._base_keys: dict[bool, object] = {}  # head or not -> the key fields its pieces share

    def key(self, kind: str, signature: str, args: tuple):
        """The piece's key, naming the executors and options it is traced with (heads': no fusion)."""
        head = kind.startswith("head")
        if head not in self._base_keys:  # made on first use: the model and options are final by then
            self._base_keys[head] = make_key(self.program, self.config, *describe_options(self._options[head]))
        return piece_key(self._base_keys[head], kind, signature, args)

    def name(self, key) -> str:
        return self.store.path(key).name

    def load(self, key) -> TracedPiece | None:
        record = self.store.load(key)
        if record is None:
            return None
        try:
            return piece_from_record(record)
        except Exception as e:
            warn(f"compile cache entry {self.name(key)} ignored, retracing: unloadable ({type(e).__name__}: {e})")
            return None

    def save(self, key, piece: TracedPiece) -> None:
        if piece.record is None:
            warn(f"{key.piece} program for rows {key.rows} not stored in the compile cache: {piece.not_stored}")
            return
        self.store.save(key, piece.record)

    def load_blocks(self, args: tuple) -> tuple[set, list[TracedPiece]] | None:
        """(the values found not to matter, the block programs) stored for this shape; None unless every
        program of its layout loads (all or nothing: a shape's blocks are then traced afresh)."""
        layout = self.store.load(self.key("layers", "", args))
        if layout is None:
            return None
        pieces = [self.load(self.key("block", digest, args)) for digest in layout["blocks"]]
        if any(piece is None for piece in pieces):
            return None
        return paths_from_json(layout["ignored"]), pieces

    def save_blocks(self, shared: SharedTraces, args: tuple) -> None:
        """After the first pass over every layer: the block programs and the layout, unless they all
        came from the store."""
        if all(piece.jitted is None for piece in shared.traces):
            return
        digests = [shared.digest(piece) for piece in shared.traces]
        for digest, piece in zip(digests, shared.traces):
            self.save(self.key("block", digest, args), piece)
        if all(piece.record is not None for piece in shared.traces):
            ignored = paths_to_json(shared.ignored)
            self.store.save(self.key("layers", "", args), dict(ignored=ignored, blocks=digests))
