import os

# Tests run on the CPU with a few virtual devices so sharded code paths run everywhere.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
