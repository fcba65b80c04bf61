"""python -m cuflash: the command line (see cuflash/cli.py)."""
from .cli import main

main(prog_name="cuflash")
