"""`python -m utils.tiny_model`: the command scripts and users have long run; the code is utils/models/tiny.py."""

from utils.models.tiny import main

if __name__ == "__main__":
    main()
