"""backfit.server"""
