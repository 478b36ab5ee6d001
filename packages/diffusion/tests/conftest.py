import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
pytest_plugins = ["polyrl.testing"]
