"""`python -m solutions.part6_lab`: every experiment of the lab, with its defaults (solutions/part6_lab/__init__.py)."""

from solutions.part6_lab import main

if __name__ == "__main__":
    main()
