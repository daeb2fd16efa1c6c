"""`python -m clover_export.cli`: the same as the `clover-export` command."""

from clover_export.cli import main

main()
