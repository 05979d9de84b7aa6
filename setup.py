"""owt_tf: Krizhevsky's 'one weird trick' (conv data-parallel, FC model-parallel) in TF2/Keras 3."""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent


def requirements():
    lines = (HERE / "requirements.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


setup(
    name="owt_tf",
    version="0.1.0",
    description=__doc__,
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["owt_tf", "owt_tf.*"]),
    python_requires=">=3.10",
    install_requires=requirements(),
    extras_require={
        # what the test suite needs besides the library: pytest and pytest-xdist (the suite
        # runs in 2 processes: a test is mostly single-threaded tracing), the plot of the
        # study, and the export consumers it loads the SavedModel into (ONNX)
        "test": ["pytest>=8", "pytest-xdist>=3.5", "matplotlib>=3.8", "tf2onnx>=1.17",
                 "onnxruntime>=1.20"],
        "study": ["matplotlib>=3.8"],
    },
)
