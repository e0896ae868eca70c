"""The probe kit: everything that touches torch."""
