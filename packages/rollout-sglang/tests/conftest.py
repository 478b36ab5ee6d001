import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
pytest_plugins = ["polyrl.testing"]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and SGLang")
