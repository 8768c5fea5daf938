"""Data-plane tiers: the bytes of KV blocks in HBM, DRAM and SSD.

Owns: storage engines that hold block bytes. Must not decide what lives where
(that is the TierManager and its policies) and must not keep block metadata
beyond what a warm restart needs to rebuild it (the SSD value header).
"""
