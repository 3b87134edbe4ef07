"""Elastic ``fit``: commit, roll back and re-form on a membership change."""
