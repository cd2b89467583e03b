"""What the bench scripts share: the compared systems (``systems``), the timing harness
(``timing``), the machine's limit for a step (``machine_limit``), the zoo of models written the
way public code bases write them (``zoo``, ``zoo_forward``, ``zoo_shared``; the tests compile
them too) and those models at the bench's sizes (``zoo_cases``), and ``gpu_check``'s report
rows and CUDA timing (``gpu``)."""
