"""Fixtures and truth helpers shared by every test folder."""
