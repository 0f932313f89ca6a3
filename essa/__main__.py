"""``python -m essa``: the ESSA trainer (see essa.trainer)."""
from essa.trainer import main

if __name__ == "__main__":
    main()
