"""backfit.verify"""
