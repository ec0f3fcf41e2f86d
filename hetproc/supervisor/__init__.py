"""The supervisor process (``python -m hetproc.supervisor``): it owns every named object of
a platform, validates and schedules every client's requests, runs the devices, the watchdog
and the recovery, and reclaims memory only once no device can touch it. Nothing outside
this folder imports it: clients speak to it over the control socket (``hetproc._protocol``).
"""
