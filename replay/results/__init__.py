"""From a run's journal to its figures: metrics, reports, comparisons with their
paired verdicts, SLOs.
"""
