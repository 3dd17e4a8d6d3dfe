"""backfit.runtime"""
