"""What the bench scripts share: the compared systems (``systems``), the timing harness
(``timing``), the machine's limit for a step (``machine_limit``) and the zoo's models at the
bench's sizes (``zoo_cases``)."""
