"""``python -m memkit`` runs the command line."""

from memkit.cli import main

if __name__ == "__main__":
    main()
