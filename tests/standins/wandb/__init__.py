"""TEST STAND-IN (never shipped) for wandb: megatron.rl.rl_utils imports
``wandb.wandb_run`` only for a type annotation, and the real wheel (26 MB)
does not travel to the GPU machine. Nothing is logged to wandb."""
