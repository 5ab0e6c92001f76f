"""The plan advisor (`jaxpar.plan`, `run.py --plan`): meshes x strategies x remat policies for a model on N devices
of a hardware profile, priced by the cost model from one compiled step per mesh, and ranked."""

from jaxpar.advisor.advise import MAX_DEVICES, Search, advise
from jaxpar.advisor.candidates import (DEFAULT_CODECS, DEFAULT_PERIODS, DEFAULT_REMATS, Candidate, factorizations,
                                       mesh_specs)
from jaxpar.advisor.ranking import lines

__all__ = ["DEFAULT_CODECS", "DEFAULT_PERIODS", "DEFAULT_REMATS", "MAX_DEVICES", "Candidate", "Search", "advise",
           "factorizations", "lines", "mesh_specs"]
