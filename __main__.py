"""`python -m flare` is the `flare` command."""

from flare.cli import main

main()
