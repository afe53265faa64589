"""Subcommands that live in their own modules register here."""

from . import doctor, slurm

REGISTER = [doctor.register, slurm.register]
