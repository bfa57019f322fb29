from thunder_batch.cli.main import main

main()
