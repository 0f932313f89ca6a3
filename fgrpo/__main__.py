"""``python -m fgrpo``: the F-GRPO trainer (see fgrpo.trainer)."""
from fgrpo.trainer import main

if __name__ == "__main__":
    main()
