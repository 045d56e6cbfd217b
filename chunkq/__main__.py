from chunkq.cli import main

main()
