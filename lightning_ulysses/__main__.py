from lightning_ulysses.cli import main

main()
