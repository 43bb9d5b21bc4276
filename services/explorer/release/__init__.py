"""Releasing a candidate version: the release controller (canary, promotion, rollback) and the
evaluation it runs.
"""
