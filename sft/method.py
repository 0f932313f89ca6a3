"""The SFT stage as the package registers it (setup.py's ``hpc.methods``:
``sft = sft.method:METHOD``)."""
from hpc.runtime.methods import MethodSpec

METHOD = MethodSpec(
    name="sft", command="hpc-sft",
    about="LoRA SFT stage: writes <run.out>/adapter (peft format) and sft.h5.",
    section="sft.config:SFTConfig", job="sft.config:SFTJobConfig",
    trainer="sft.trainer:main", plan="sft.plan")
