from ignition.cli import main

main()
