"""The engine: decides what runs (requests, scheduling, sampling parameters, text out); imports
runtime, never the other way."""
