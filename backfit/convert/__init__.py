"""backfit.convert"""
