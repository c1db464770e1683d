"""`python -m utils.default_model`: the command scripts and users have long run; the code is utils/models/default.py."""

from utils.models.default import main

if __name__ == "__main__":
    main()
