"""``python -m megamoe_cli`` is the ``megamoe`` command."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="megamoe")
