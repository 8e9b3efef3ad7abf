"""slurm-nebula-power: Slurm power saving for OpenNebula GPU clouds."""

__version__ = "0.1.0"
