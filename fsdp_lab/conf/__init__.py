"""fsdp_lab's Hydra config groups, shipped inside the package (``pkg://fsdp_lab.conf``): one
folder per group, one YAML per option, and the chat templates. In a checkout, ``conf/`` at the
top is a link to this folder."""
