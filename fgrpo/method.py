"""F-GRPO as the package registers it (setup.py's ``hpc.methods``:
``fgrpo = fgrpo.method:METHOD``)."""
from hpc.runtime.methods import MethodSpec

METHOD = MethodSpec(
    name="fgrpo", command="fgrpo",
    about="F-GRPO: GRPO with focal-weighted group advantages, LoRA or full fine-tuning, data "
          "parallel; writes fgrpo.h5, adapter and checkpoints/.",
    section="fgrpo.config:FGRPOConfig", job="fgrpo.config:FGRPOJobConfig",
    trainer="fgrpo.trainer:main", plan="fgrpo.plan")
