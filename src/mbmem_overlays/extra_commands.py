"""Subcommands that live in their own modules (plan, doctor, slurm, recommend) register here."""

REGISTER: list = []
