"""``python -m frolic_tta.demo``: see :mod:`frolic_tta.demo`."""

from frolic_tta.demo.run import main

if __name__ == "__main__":
    main()
