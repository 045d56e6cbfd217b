from chunkq.supervisor.cli import main

main()
