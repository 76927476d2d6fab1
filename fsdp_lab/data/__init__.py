"""Corpora to tokenised, packed blocks, and each rank's resumable share of every batch. Imports
config only.
"""
