"""Booking, the ledger, batching, boot fall-back and prices: hooks + core, no Airflow."""
