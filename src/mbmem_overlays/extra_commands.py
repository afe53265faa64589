"""Subcommands that live in their own modules register here."""

from . import doctor

REGISTER = [doctor.register]
