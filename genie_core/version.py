"""The version of Genie (core and notebook extension ship together)."""

__version__ = "0.1.0"
