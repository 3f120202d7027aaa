from helios.cli import main

main()
