"""ESSA as the package registers it (setup.py's ``hpc.methods``: ``essa = essa.method:METHOD``)."""
from hpc.runtime.methods import MethodSpec

METHOD = MethodSpec(
    name="essa", command="essa",
    about="ESSA: CMA-ES over the singular values of an SFT LoRA adapter (lora.adapter); writes "
          "essa.h5, adapter-mean, adapter-best and checkpoints/.",
    section="essa.config:ESSAConfig", job="essa.config:ESSAJobConfig",
    trainer="essa.trainer:main", plan="essa.plan")
