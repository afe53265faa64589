"""Subcommands that live in their own modules register here."""

from . import doctor, planner, slurm

REGISTER = [doctor.register, slurm.register, planner.register, planner.register_recommend]
