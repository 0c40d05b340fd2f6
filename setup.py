"""tf_dpiter: differentially private iterative training for TensorFlow 2.21 and Keras 3."""

from setuptools import find_packages, setup

setup(
    name="tf_dpiter",
    version="0.1.0",
    description="Differentially private iterative training for TensorFlow and Keras 3: "
                "DPQuery mechanisms, a privacy ledger, dp-accounting accountants, Keras "
                "optimizers, DP federated averaging and Draw and Discard.",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["tf_dpiter", "tf_dpiter.*"]),
    install_requires=[
        "tensorflow==2.21.*",
        "tensorflow-probability==0.25.*",
        "tf-keras==2.21.*",
        "dp-accounting==0.6.*",
        "scipy",            # auditing bounds, also a dependency of dp-accounting
        "numpy>=2",
        "absl-py",
        "aiohttp>=3.9",     # Draw-and-Discard HTTP service
        "redis>=5",         # Draw-and-Discard shared k-instance store
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "scipy", "matplotlib", "flwr>=1.38,<1.39"],
        "flower": ["flwr>=1.38,<1.39"],
        "auditing": ["matplotlib"],     # the PNG privacy report (scipy comes with dp-accounting)
    },
    entry_points={
        "console_scripts": [
            "compute_dp_sgd_privacy=tf_dpiter.accounting.cli:compute_dp_sgd_privacy_main",
            "compute_noise_from_budget=tf_dpiter.accounting.cli:compute_noise_from_budget_main",
            "dp_ledger=tf_dpiter.accounting.cli:dp_ledger_main",
            "tf-dpiter-ddml=tf_dpiter.draw_discard.cli:main",
        ],
    },
)
