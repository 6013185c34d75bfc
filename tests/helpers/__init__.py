"""What more than one test module uses: the bit-exact comparisons, fresh
interpreters, mlx-lm model folders and patch checks, thread runs. Imported
as ``helpers.<module>``: the test folder is on ``sys.path`` (pytest puts the
folder of tests/conftest.py there, and run_python's interpreters get it on
PYTHONPATH)."""
