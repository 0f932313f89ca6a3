"""ESSA against F-GRPO: the scaling model (``hpc-scaling``), which predicts and measures the time
to a target accuracy of both methods from their memory plans, run files and GPU checks. It stands
above both methods, the only package that names them together."""
