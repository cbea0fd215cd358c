# moat's reaper for amd64: see subprocess/reaper.go.
	.intel_syntax noprefix
	.text
	.globl _start
	.set base, 0x400000
ehdr:
	.byte 0x7f, 'E', 'L', 'F', 2, 1, 1, 0	# ELF64, little-endian, version 1, SysV
	.quad 0
	.short 2				# ET_EXEC
	.short 62				# EM_X86_64
	.int 1					# EV_CURRENT
	.quad base + _start - ehdr		# e_entry
	.quad phdr - ehdr			# e_phoff
	.quad 0					# e_shoff
	.int 0					# e_flags
	.short 64				# e_ehsize
	.short 56				# e_phentsize
	.short 1				# e_phnum
	.short 0, 0, 0				# e_shentsize, e_shnum, e_shstrndx
phdr:
	.int 1					# PT_LOAD
	.int 5					# PF_R | PF_X
	.quad 0					# p_offset
	.quad base				# p_vaddr
	.quad base				# p_paddr
	.quad end - ehdr			# p_filesz
	.quad end - ehdr			# p_memsz
	.quad 0x1000				# p_align
_start:
	mov	eax, 157			# prctl(PR_SET_NAME, name): not "7"
	mov	edi, 15				# (the comm of /proc/self/fd/7)
	lea	rsi, [rip+name]
	syscall
	mov	rsi, [rsp+16]			# argv[1]: python3's pid, in decimal
	test	rsi, rsi
	jz	fail
	xor	r12d, r12d
digit:
	movzx	eax, byte ptr [rsi]
	test	eax, eax
	jz	parsed
	sub	eax, '0'
	cmp	eax, 9
	ja	fail
	imul	r12d, r12d, 10
	add	r12d, eax
	inc	rsi
	jmp	digit
parsed:
	test	r12d, r12d
	jz	fail
	sub	rsp, 160			# the report: magic, wait status, rusage
	mov	rax, 0x0a646e6574616f6d		# "moatend\n" little-endian
	mov	[rsp], rax
wait:						# wait4(-1, &status, 0, &rusage)
	mov	eax, 61
	mov	edi, -1
	lea	rsi, [rsp+8]
	xor	edx, edx
	lea	r10, [rsp+16]
	syscall
	cmp	rax, -4				# EINTR
	je	wait
	test	rax, rax
	js	fail
	cmp	eax, r12d
	jne	wait				# an orphan of the run: reaped
	mov	eax, 62				# kill(-1, SIGKILL): the rest of the run
	mov	edi, -1
	mov	esi, 9
	syscall
drain:						# wait4(-1, 0, 0, 0) until ECHILD
	mov	eax, 61
	mov	edi, -1
	xor	esi, esi
	xor	edx, edx
	xor	r10d, r10d
	syscall
	cmp	rax, -4
	je	drain
	test	rax, rax
	jns	drain
	mov	eax, 3				# close(1), close(2)
	mov	edi, 1
	syscall
	mov	eax, 3
	mov	edi, 2
	syscall
	mov	eax, 1				# write(3, report, 160)
	mov	edi, 3
	mov	rsi, rsp
	mov	edx, 160
	syscall
	xor	edi, edi
	jmp	exit
fail:
	mov	edi, 125
exit:
	mov	eax, 231			# exit_group
	syscall
name:
	.asciz "moat-reaper"
end:
